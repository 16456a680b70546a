"""eldr's pipeline stages: capture, fit, serve, bench, and the formats they share."""
