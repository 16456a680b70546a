"""Operations: health probes and self-checks, metrics."""
