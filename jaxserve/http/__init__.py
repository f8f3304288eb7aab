"""The HTTP server: the aiohttp app, request validation and classes, the request path, routes per API
family, metrics and the OpenAPI document."""
