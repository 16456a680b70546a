"""Recording live traffic (``eldr serve --record``) as signature rows."""
