"""The terms of KV-aware routing's one objective, each in seconds of the cluster's time.

Routing is filter -> scorers -> pick: the policy keeps the workers a request may go to, adds
what each scorer says the request would cost on each of them, and picks the cheapest. A scorer
is a function of the request and the engine's measured costs (``stages.routing.cost_model``),
in a folder of its own with its test, so a new signal is one folder:

- ``prefill_queue``: a prefill worker's queue and the prompt tokens it lacks, at the measured
  prefill time per uncached token;
- ``kv_pull``: the prompt tokens a decode worker lacks, pulled from the prefill worker at the
  measured transfer time per token;
- ``load``: the decode step time a request adds to a worker's batch, blind to experts;
- ``residual_load``: a worker's requests counted by the steps they will share with the new one;
- ``step_wait``: the new request's wait for the step a busy worker is running (once);
- the expert union: eldr-union's step-time increase for the experts a request adds
  (``stages.routing.policies.eldr_union``), per decode step.

Decode terms per step become seconds over the request's life by its expected output tokens.
"""
