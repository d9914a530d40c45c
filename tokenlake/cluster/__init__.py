"""The instances: placement by rendezvous hashing, slots, load balancing, load model, profiles."""
