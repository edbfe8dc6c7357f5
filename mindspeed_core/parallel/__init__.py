"""Parallel layers and process-group state (tensor, sequence, pipeline, context, expert
parallelism), written against the facade only. Filled by the distributed-training issues."""
