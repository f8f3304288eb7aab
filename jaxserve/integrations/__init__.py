"""jaxserve inside other systems: Ray Serve replicas, and starting a server process and waiting for it."""
