"""The fused batched steer in Triton (CUDA; CPU through ``TRITON_INTERPRET=1``).

Semantics: see :mod:`vllm_steer.reference` (``steer_reference``). Design, measurements and
limits: ``docs/kernels.md``.

Three launches, punica-style: the segments (the rows grouped by steer), the shrink (each used
steer's down-projection over the rows that use it, scaled by their coefficients) and the
expand (the up-projection, the residual add and the output, every element written once).
One module per concept:

- :mod:`.jit`: the ``@triton.jit`` kernels (private; their design and precision);
- :mod:`.launch`: :func:`~.launch.steer_triton`, the public wrapper that checks the operands and
  launches the shrink and the expand, and :func:`~.launch.steer_triton_replayable`, the same op
  as a CUDA graph can record it;
- :mod:`.plan`: :func:`~.plan.prepare_triton`, a batch's steering planned once
  (:class:`~.plan.TritonPlan`) and reused by every step while its coefficients keep their
  pattern;
- :mod:`.segments`: the rows grouped by steer, on the device or from a host copy;
- :mod:`.tables`: the bank layout's device tables, cached per layout;
- :mod:`.tiling`: the tile policy (:class:`~.tiling.Tiles`, :func:`~.tiling.choose_tiles`,
  batch invariance) and the kernels' compile-time parameters;
- :mod:`.warmup`: :func:`~.warmup.specializations`, the binaries 1..max_rows rows can need, and
  :func:`~.warmup.warm_up`, which compiles them at start-up.

Importing this package imports nothing (not Triton): name the module of the concept.
"""
