"""How engine processes talk: sockets, authenticated frames, messages, peers and their liveness, the point-to-point process group and per-layer doorbells. Imports tokenlake's public face only."""
