"""The Llama-family model engine: load a Hugging Face checkpoint, run it through the pool.

Modules: :mod:`.config` (``ModelConfig`` from ``config.json``), :mod:`.checkpoint`
(safetensors), :mod:`.rope`, :mod:`.llama` (the decoder split at its attention),
:mod:`.engine` (one iteration → logits), :mod:`.sampling`, :mod:`.tokenizer`, :mod:`.tiny`
(the seeded ``tiny-random`` checkpoint).
"""
