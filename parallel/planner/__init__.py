"""Parallel strategy planner: pick DP/TP/PP/VPP/EP/ETP, micro-batches and recompute for a MoE model on a cluster.

model_shape  the planner's description of the model: exact parameters, training FLOPs, per-device static memory
cluster      cluster YAMLs (clusters/*.yaml, each figure with its source)
machine      probes of this machine: GEMM rate, memory bandwidth, loopback link, MindSpore op overhead
calibrate    the runtime model fitted to measured training steps (scripts/calibrate_cluster.py measures them)
workload     what is priced: the model on a cluster, its precision, candidate layouts as arrays (Layouts)
costing      the priced primitives: GEMM roofline, memory streams, collectives, the expert-parallel exchange
blocks       each block kind's time, activations and parameters for one micro-batch, from costing's primitives
cost_model   vectorised time and memory of a step for many layouts at once (the "what overlaps" notes are there)
search       enumerate + prune the layout space as NumPy arrays and score it in one pass
stage_ilp    layers and recompute per pipeline chunk: scipy.optimize.milp (HiGHS), and brute force to check it
simulate     one layout through parallel.pipeline's event-driven simulator with the same costs
refine       search -> ILP-balanced, simulator-checked short list; nearest feasible alternatives
report       table, step-time-vs-memory PNG, a recipe written with the pick
The entry point is `python -m telechat_moe.plan` (on the application's side: it reads recipes).
"""
