"""Framework backends of the facade.

Each backend is a package with the same module names (Keras 3 style), one per facade
namespace (:data:`mindspeed_core.facade.NAMESPACES`), so that the facade is "the module of
the bound backend" and nothing else:

    ops       tensors, math, fused operators (native kernel or composite fallback)
    nn        Module / Parameter, parameter naming, state dicts, initializers
    autograd  value_and_grad, vjp, custom Function, no_grad, recompute
    random    seeding, RNG state, the named RNG-state tracker
    dist      process groups and collectives (native or emulated)
    device    device selection, synchronisation, memory, matmul-rate measurement, determinism
    io        safetensors files with JSON metadata
    profiler  the framework's profiler: a window of steps, its trace files, operator times

The contract of every name is in :mod:`mindspeed_core.facade`.
"""
