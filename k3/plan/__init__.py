"""Placement planning: where a model's weights, experts and caches go on a cluster, and what a step costs
(``k3 plan``)."""
