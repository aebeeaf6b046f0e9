"""GPU benchmarks behind ``k3 bench``; each prints a table and writes JSON + markdown results."""
