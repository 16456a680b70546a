"""`eldr report`: the bench's results and the fit's artifacts on one shareable HTML page
(``inputs`` reads them into a typed model, ``page`` renders it)."""
