"""The Neuron runtime: trn2 bundles on NeuronCores, through libnrt.

- `libnrt`: the ctypes binding to libnrt.so (its C API, status codes and errors).
- `device`: one NeuronCore per process: device tensors, loaded NEFFs, executables with the call API
  of `runtime.backends`.
- `placement`: a trn2 bundle on one core (`NeuronPlacement`, what `backends.placement_for` returns):
  resident weights and pools, layer views as slices, one NEFF per (kind, bucket).
- `collectives`: where the ranks' in-NEFF collectives meet (NEURON_RT_ROOT_COMM_ID), prepared on
  every rank before anything is loaded.
- `arrival`: the bounded wait at those collectives (a rank that never arrives ends the run, named).

Imported only where a trn2 bundle runs or ranks start (`backends`, `ranks`): `import deepinfer.runtime`
never loads libnrt.
"""
