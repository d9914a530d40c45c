"""`tokenlake launch`: the server on a Ray cluster (placement, rendezvous, actors, the driver and its data plane). Imports serve's runtime, engines.clusters and engines.transport."""
