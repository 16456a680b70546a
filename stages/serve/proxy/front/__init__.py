"""The front: routes, admission, reading and checking a request, batch split and merge."""
