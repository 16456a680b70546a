"""The proxy's settings: one frozen value, validated once, passed to ``create_app``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from stages.errors import EldrError
from stages.routing.policies import POLICIES, reads_signatures
from stages.routing.policy_config import PolicyConfig
from stages.serve.proxy.recording.recorder import RecordConfig

if TYPE_CHECKING:
    from stages.signature.dataset import ModelIdentity


@dataclass(frozen=True)
class Ejection:
    """When a worker that keeps failing requests leaves rotation, and for how long
    (``view.workers.WorkerPool``)."""

    after_failures: int = 5  # request failures in a row (5xx, KV-load errors, resets)
    base_s: float = 10.0
    max_s: float = 300.0

    def __post_init__(self) -> None:
        if self.after_failures < 1 or not 0 < self.base_s <= self.max_s:
            raise EldrError(f"outlier ejection needs after_failures >= 1 and 0 < base_s <="
                            f" max_s, got {self}")

# A worker that owes KV events this long (a request sent that stores blocks, none came) is
# routed on load alone until it publishes again.
DEFAULT_SILENT_AFTER_S = 5.0


@dataclass(frozen=True)
class KVConfig:
    """KV-cache-aware routing: where each worker publishes vLLM's KV events, and how to
    turn a request into the block hashes the workers compute (stages.routing.kv)."""

    tokenizer: str  # the workers' --model (a directory or hub id): tokenizer, chat template
    prefill_events: tuple[str | None, ...]  # one endpoint per prefill worker (None: none)
    decode_events: tuple[str | None, ...]
    hash_algo: str = "sha256"  # the workers' --prefix-caching-hash-algo
    silent_after_s: float = DEFAULT_SILENT_AFTER_S
    # Where each worker publishes its blocks' expert counts, prefill workers first (empty:
    # none do; stages.capture.expert_events).
    expert_events: tuple[str | None, ...] = ()
    # Per prefill worker, the compute it shares (equal: the same cores or GPU, as
    # ``launcher.shared_compute`` groups them; empty: each its own). A prefill worker is priced
    # by its group's queue: co-located workers take turns, so an idle one beside a busy one is
    # not free.
    prefill_compute: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        from stages.routing.kv.block_hashes import HASH_ALGOS

        object.__setattr__(self, "expert_events", tuple(self.expert_events))
        workers = len(self.prefill_events) + len(self.decode_events)
        if self.expert_events and len(self.expert_events) != workers:
            raise EldrError(f"{len(self.expert_events)} expert event endpoints for {workers}"
                            " workers")

        object.__setattr__(self, "prefill_compute", tuple(self.prefill_compute))
        if self.prefill_compute and len(self.prefill_compute) != len(self.prefill_events):
            raise EldrError(f"{len(self.prefill_compute)} compute groups for"
                            f" {len(self.prefill_events)} prefill workers")
        object.__setattr__(self, "prefill_events", tuple(self.prefill_events))
        object.__setattr__(self, "decode_events", tuple(self.decode_events))
        if self.hash_algo not in HASH_ALGOS:
            raise EldrError(f"unknown hash algorithm {self.hash_algo!r}; vLLM's are"
                            f" {', '.join(HASH_ALGOS)}")
        if not self.silent_after_s > 0:
            raise EldrError(f"silent_after_s must be > 0, got {self.silent_after_s}")


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    policy: str = "eldr"
    # Options per policy name (validated when made); the admin API may switch to any of them.
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    # Where `eldr fit` wrote artifacts; None runs without one (signature-blind policies only).
    artifact_store: Path | None = None
    artifact_version: str = "latest"
    # Filled into requests that name no model; None leaves requests untouched.
    model: str | None = None
    # The served model's experts per token (its config): lets policies that route on raw
    # counts (eldr-union) work without an artifact.
    model_top_k: int | None = None
    connect_timeout_s: float = 3.0
    # Prefill answers only after the whole prompt ran, so its read timeout covers a prefill.
    prefill_timeout_s: float = 120.0
    # Longest silence allowed between two decode chunks (or a whole non-streamed decode).
    decode_timeout_s: float = 600.0
    # A decode stream's first event (the KV pulled, one token decoded): a worker that took the
    # request and hangs fails over after this. Generous: the KV of a long prompt on a busy
    # worker takes a while.
    first_token_timeout_s: float = 120.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    # Workers tried per leg (prefill, decode) before the request fails.
    max_attempts: int = 3
    # When a worker that keeps failing requests leaves rotation for a while (workers.py).
    ejection: Ejection = field(default_factory=Ejection)
    max_body_bytes: int = 8 * 1024 * 1024
    # Sequences (prompts x n) one request may ask for: each is a prefill and a decode of its
    # own, so a larger fan-out is refused rather than multiplied onto the workers.
    max_fanout: int = 1024
    max_connections: int = 4096
    # Each decode worker's batch size (vLLM --max-num-seqs) when known; load-capped policies
    # keep requests off a full worker while another has room.
    decode_slots: int | None = None
    # Load shedding: requests in flight beyond the decode workers' batch slots (all of them
    # when the slots are unknown) past which a new one gets 503 with Retry-After. None: no
    # bound.
    max_queued: int | None = None
    online_refit: bool = False
    refit_window_s: float = 5.0
    refit_interval_s: float = 2.0
    seed: int = 0
    # The served model: a worker (re)joining rotation must first answer a self-check prompt
    # with a signature of its shape (proxy.ops.rejoin). None: no check (a proxy built by
    # hand, tests); eldr serve sets it unless --skip-self-check.
    self_check: ModelIdentity | None = None
    self_check_timeout_s: float = 120.0  # as the start-up check's (self_check.CHECK_TIMEOUT_S)
    # eldr serve's start-up check passed for every worker: they start verified.
    checked_at_start: bool = False
    # The address the proxy listens on: with no admin key, /admin is open on loopback only.
    host: str = "127.0.0.1"
    # Other proxies in front of the same workers (each one process, as its base URL): admin
    # changes made here reach them, and /metrics here includes theirs (proxy.front.peers).
    peers: tuple[str, ...] = ()
    # This proxy's name among its peers: the `proxy` label of the merged /metrics.
    proxy_id: str = "0"
    # Where each decode worker publishes its running batch (ZMQ; None for one that does not),
    # in decode_urls order; empty: none do. Routing then adds the other proxies' requests.
    decode_batch_endpoints: tuple[str | None, ...] = ()
    # A worker silent this long is taken to hold none of the other proxies' requests.
    batch_stale_after_s: float = 2.0
    # --skip-self-check: the workers may be plain vLLM, so no policy may read signatures.
    skip_self_check: bool = False
    # Append the requests routed to a signature dataset (`eldr serve --record`); needs every
    # decode worker's batch endpoint (the workers measure and publish each request's decode).
    record: RecordConfig | None = None
    # KV-cache-aware routing (policy eldr-kv); None: no KV events are followed.
    kv: KVConfig | None = None
    # Bearer keys as vLLM's --api-key: clients must send `api_key` on /v1/* and
    # `admin_api_key` on /admin/* (refused, with api_key and no admin_api_key). `worker_api_key`
    # is what the proxy sends to its workers; a client's own key is never passed on. Kept out
    # of repr so a logged config never shows them.
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    worker_api_key: str | None = field(default=None, repr=False)

    # Requests in flight (prefilling or decoding) past which new ones are shed; None: none
    # are. Derived from max_queued and the decode slots (set in __post_init__).
    admission_limit: int | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Accept lists from callers that build configs from JSON/CLI, but store tuples so the
        # value stays hashable and immutable.
        object.__setattr__(self, "prefill_urls", tuple(u.rstrip("/") for u in self.prefill_urls))
        object.__setattr__(self, "decode_urls", tuple(u.rstrip("/") for u in self.decode_urls))
        slots = (self.decode_slots or 0) * len(self.decode_urls)
        limit = None if self.max_queued is None else slots + self.max_queued
        object.__setattr__(self, "admission_limit", limit)
        object.__setattr__(self, "peers", tuple(u.rstrip("/") for u in self.peers))
        object.__setattr__(self, "decode_batch_endpoints", tuple(self.decode_batch_endpoints))
        if self.decode_batch_endpoints and len(self.decode_batch_endpoints) != len(
                self.decode_urls):
            raise EldrError(f"{len(self.decode_batch_endpoints)} batch endpoints for"
                            f" {len(self.decode_urls)} decode workers")
        if self.record is not None and (
                not self.decode_batch_endpoints or None in self.decode_batch_endpoints):
            raise EldrError("recording needs every decode worker's batch endpoint: the workers"
                            " measure each request's decode and publish it there")
        if self.artifact_store is not None:
            object.__setattr__(self, "artifact_store", Path(self.artifact_store))
        if self.kv is not None and (len(self.kv.prefill_events) != len(self.prefill_urls)
                                    or len(self.kv.decode_events) != len(self.decode_urls)):
            raise EldrError("KV event endpoints: one per worker, prefill and decode")
        if not self.prefill_urls:
            raise EldrError("the proxy needs at least one prefill worker url")
        if not self.decode_urls:
            raise EldrError("the proxy needs at least one decode worker url")
        for url in (*self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise EldrError(f"worker url must start with http:// or https://, got {url!r}")
        if len(set(self.decode_urls)) != len(self.decode_urls):
            raise EldrError("decode worker urls must be distinct")
        if self.policy not in POLICIES:
            raise EldrError(f"unknown policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        if self.decode_slots is not None and self.decode_slots < 1:
            raise EldrError(f"decode slots must be >= 1, got {self.decode_slots}")
        for name in (
            "connect_timeout_s",
            "prefill_timeout_s",
            "decode_timeout_s",
            "first_token_timeout_s",
            "health_interval_s",
            "health_timeout_s",
            "refit_window_s",
            "refit_interval_s",
            "self_check_timeout_s",
            "batch_stale_after_s",
        ):
            if not getattr(self, name) > 0:
                raise EldrError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.peers and self.online_refit:
            # Each proxy would refit its own centroids from its own share of the traffic, and
            # the proxies would then route on different clusterings.
            raise EldrError("online refit runs in one proxy: it cannot be combined with"
                            " several proxies (--proxy-workers, --peer)")
        if self.max_queued is not None and self.max_queued < 0:
            raise EldrError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.max_attempts < 1:
            raise EldrError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_body_bytes < 1 or self.max_connections < 1 or self.max_fanout < 1:
            raise EldrError("max_body_bytes, max_connections and max_fanout must be >= 1")
        for name in ("api_key", "admin_api_key", "worker_api_key"):
            check_key(name, getattr(self, name))
        if self.checked_at_start and self.self_check is None:
            raise EldrError("checked_at_start needs self_check: the model the check was for")
        if self.skip_self_check:
            if self.self_check is not None:
                raise EldrError("skip_self_check and self_check exclude each other")
            check_unchecked_policy(self.policy)


def check_unchecked_policy(policy: str) -> None:
    """Refuse a policy that reads signatures on workers never shown to record them."""
    if reads_signatures(policy):
        blind = ", ".join(name for name in POLICIES if not reads_signatures(name))
        raise EldrError(
            f"policy {policy!r} reads expert signatures, but the workers were not self-checked"
            f" (--skip-self-check) and may send none: use a policy that reads none ({blind}),"
            " or serve without --skip-self-check"
        )


def check_key(name: str, key: str | None) -> None:
    # An empty key would read as "auth on" to a reader and as "off" to vLLM; and a key that
    # cannot travel in a header as sent (non-ASCII, control characters, edge spaces) could never
    # match. The message never repeats the key.
    if key is None:
        return
    if not isinstance(key, str) or not key:
        raise EldrError(f"{name} must be a non-empty string (or unset)")
    if not (key.isascii() and key.isprintable()) or key != key.strip():
        raise EldrError(
            f"{name} must be printable ASCII without leading or trailing spaces"
        )
