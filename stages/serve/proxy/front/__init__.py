"""The front: routes (the completions, the admin and the operator endpoints), admission, reading
and checking a request, batch split and merge."""
