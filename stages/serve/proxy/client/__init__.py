"""The one HTTP client every call to a worker or a peer goes through, its timeouts, its errors."""
