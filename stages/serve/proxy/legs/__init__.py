"""The legs: a request's prefill and decode on the workers, the relay, the retries."""
