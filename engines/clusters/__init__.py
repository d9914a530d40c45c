"""Data planes of N instances: in process, one process per engine, compute processes, and the launcher that spawns them. Imports engines.core, engines.client, engines.transport."""
