"""The distributed verify runtime: router, reference forward, dispatchers, experts backends,
the per-layer driver and the rank launcher. Works on in-memory tensors; loading shards and
reference checkpoints is the caller's job."""
from moetool.verify.dispatch import (
    All2AllDispatcher,
    AllGatherDispatcher,
    Dispatcher,
    Topology,
    get_dispatcher,
)
from moetool.verify.experts import ExpertsBackend, TorchExperts, TritonExperts, get_experts
from moetool.verify.launch import run_under_torchrun, spawn_world
from moetool.verify.layer import run_moe_layer
from moetool.verify.reference import reference_moe_forward
from moetool.verify.router import route

__all__ = [
    "All2AllDispatcher",
    "AllGatherDispatcher",
    "Dispatcher",
    "ExpertsBackend",
    "Topology",
    "TorchExperts",
    "TritonExperts",
    "get_dispatcher",
    "get_experts",
    "reference_moe_forward",
    "route",
    "run_moe_layer",
    "run_under_torchrun",
    "spawn_world",
]
