"""Fused operators: the ones MindSpore fuses itself, and the ones written by hand.

DVM is MindSpore's own graph-kernel fusion on Ascend: at `jit_level` O1 its compiler clusters chains of
elementwise, broadcast and reduction operators (and expands composite ones such as AddN or SiLUGrad into them)
into one `GraphKernel_<ops>_fusion` node, which DVM (in the Ascend plugin, `libmindspore_ops_ascend.so`) compiles
and runs as one kernel: the intermediate tensors between the fused operators stay on chip instead of a round trip
through device memory. Nothing of it is written here: the recipe's `fusion:` section (applied by
telechat_moe/context.py) chooses it and tunes it through MindSpore's graph-kernel flags (`--enable_expand_ops`,
`--disable_cluster_ops`, ...). On CPU the same clustering feeds AKG instead (`enable_graph_kernel`; jit_level O1
alone fuses nothing there), which is how this machine sees the fusions of a step. `report.py`
(`python -m dvm_fusion.report IR_DIR`) reads MindSpore's IR dump and lists each fused kernel, the operators inside
it and the intermediate tensors it removed.

A hand kernel is an operator written here because MindSpore's own one is missing on CPU or too general: one
kernel with its own backward, bound to the same contract on both devices.
- `grouped_matmul.py`: the MoE experts' grouped matmul. CPU: `ops.Custom` AOT kernels (kernels/grouped_matmul.cc,
  built by `native.py`) calling NumPy's OpenBLAS on MindSpore's buffers, with their own backward; Ascend: a thin
  binding of MindSpore's `GroupedMatmul` (split_item=3, group_type=0).
- `flash_attention.py`: per-document causal attention that never holds [s, s] scores. CPU: `ops.Custom` AOT kernels
  (kernels/flash_attention.cc, FlashAttention-2's blockwise online softmax with its backward); Ascend: MindSpore's
  FlashAttentionScore with the TND layout and the value heads padded.
- CPU-only kernels where MindSpore's CPU runtime is slow at a chain of small operators (Ascend keeps the chain,
  which DVM fuses): `rowwise.py` (SwiGLU, RMSNorm, rotary embedding, attention's masked softmax, the cross-entropy,
  the MoE combine, each with its own backward), `square_sums.py` (the gradient norm's squares), `adamw.py` (AdamW's
  update in place).
"""

# NumPy's OpenBLAS, which the experts' kernel calls, keeps its idle threads spinning for 2^28 cycles (about 0.1 s)
# after each call by default: on a CPU of few cores they take a core from the MindSpore kernels that run next.
# With 2^4 they sleep at once: tiny's step (MTP off, 2 cores) 304-349 -> 251-294 ms, six alternating pairs.
# OpenBLAS reads it when it loads, so a process sets it before importing NumPy (run_train.py does).
BLAS_ENVIRONMENT = {"OPENBLAS_THREAD_TIMEOUT": "4"}
