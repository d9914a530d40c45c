"""One iteration's life in the pool: admission, segment writes, sealing, in-flight set, instance loss."""
