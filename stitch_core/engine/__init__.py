"""The engine layer: applying versions in place inside a running engine, and proving the result.

Engine-agnostic (no vLLM or SGLang import): where each served element lives in an engine's
parameters (`layout`), kernels' private copies of weights kept in step (`derived`), the rank side of
an apply (`replica`) and the node's coordinator that decodes a patch once and drives every rank
(`coordinator`). Uses the format and versions layers; knows nothing of HTTP (the serve layer).
"""
