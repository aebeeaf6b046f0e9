"""The routed experts' buffer layout and kernel limits, shared by the torch path (grouped.py) and the Triton
kernels it launches (triton_route.py, small_groups.py), which must agree on them."""

ALIGN = 8  # each expert's group of rows is padded to a multiple of this (grouped_mm's 16-byte alignment)
COUNT_PAIRS = 2048  # up to this many token-expert pairs (decode, small batches) rank them by counting, not sorting
ROUTE_MAX_EXPERTS = 4096  # the Triton routing program holds one count per expert in a block of lanes
GLU_ACTS = ("silu", "situ")  # the kinds of k3.model.activation.GLU that small_groups_glu computes itself
