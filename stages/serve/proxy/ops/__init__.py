"""Operations: admin endpoints, health and self-checks, metrics, refits."""
