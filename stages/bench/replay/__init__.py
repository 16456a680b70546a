"""Live runs replayed in the simulator and judged against what they measured."""
