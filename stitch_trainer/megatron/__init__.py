"""Megatron-core TP/PP shards <-> Hugging Face tensors, for Llama/Qwen-family models.

A Megatron rank (tp_rank, pp_rank) holds local parameters such as
``decoder.layers.3.self_attention.linear_qkv.weight``; the served view is in Hugging Face layout
(``model.layers.11.self_attn.q_proj.weight`` ...). This package says, as data, where every local
element lands in the HF tensors, so a rank can diff its own shard and name the changed elements
by their *global HF flat positions* without gathering anything. One job per module; import each
name from the module that owns it:

* `stitch_trainer.megatron.tables`: the rules per architecture (`Rule`, `rule`, `LLAMA`,
  `QWEN2`, `QWEN3`, `ARCHS`, `MODEL_TYPES`, `register_arch`) and the tensor-parallel kinds.
* `stitch_trainer.megatron.placement`: `Placement`, where some rows of a local tensor land in one
  HF tensor (integer arithmetic on whole tensors).
* `stitch_trainer.megatron.layout`: `MegatronLayout`, model dimensions and parallel sizes, and the
  mapping of a local parameter to its placements (`to_hf`, `map_positions`).
* `stitch_trainer.megatron.shards`: shard-local diffing into a multi-part patch (`ShardPart`,
  `shard_parts`, `add_part`, `merge_scattered`).
* `stitch_trainer.megatron.convert`: whole conversions (`assemble_hf`, `split_hf`,
  `local_from_hf`, `hf_names_of`).

The publisher that uses them is `stitch_trainer.megatron_publisher.MegatronPublisher`.
"""
