"""The workers `eldr serve` owns: their flags, ports, start, stop and restarts."""
