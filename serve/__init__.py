"""The serving runtime (docs/architecture.md#the-floors): composes pool, scheduler and engines behind an
OpenAI-compatible HTTP API.

Modules: :mod:`.config` (``ServeConfig``), :mod:`.request` (requests and token events),
:mod:`.runtime` (the loop: requests in → scheduler step → engine → tokens out),
:mod:`.build` (composition from a config), :mod:`.protocol` (API bodies), :mod:`.text`
(detokenization, stop strings), :mod:`.api` (FastAPI app), :mod:`.metrics` (``/metrics``),
:mod:`.http_server` (uvicorn), :mod:`.cli` (``python -m tokenlake.serve``).
"""

if __name__ != "tokenlake.serve":  # one import name per module (docs/architecture.md, "Layout")
    raise ImportError(
        f"the folder serve/ is the package tokenlake.serve: import tokenlake.serve, not {__name__}"
    )
