"""TokenLake as an SGLang attention backend (``--attention-backend tokenlake``).

Nothing here is imported by the rest of TokenLake; SGLang loads :mod:`.plugin` through its
``sglang.srt.plugins`` entry point, and the plugin imports :mod:`.backend` only when SGLang
builds the backend.
"""
