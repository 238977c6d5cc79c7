"""MoE families as data: names, router, shared experts, activation; expert placement."""
