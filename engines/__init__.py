"""The data plane (docs/architecture.md, "The floors"): the engines of every instance and what
compute engines use to reach them. Wings, each importing only those listed before it:
``kernels`` (attention kernels), ``transport`` (sockets, auth, messages, peers, process groups,
doorbells), ``core`` (query and transfer engines, the executor, puts, merge, buffers),
``client`` (the engine client, driver, forward, prefix attention), ``clusters`` (in-process,
multi-process and compute-process data planes), then ``model`` and ``sglang``. The root keeps
what every wing shares: ``dataplane_config`` and ``protocol``."""

if __name__ != "tokenlake.engines":  # one import name per module (docs/architecture.md, "Layout")
    raise ImportError(
        f"the folder engines/ is the package tokenlake.engines: import tokenlake.engines, not {__name__}"
    )
