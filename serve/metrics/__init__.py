"""Prometheus families of /metrics: the pool's, the engines', the runtime's, the requests' and the SGLang host's. Imports tokenlake's public face; never serve.api."""
