"""The OpenAI-compatible HTTP server: the app and its routes (server), request schemas and checks
(protocol), response bodies (responses), key and body-size middleware, Prometheus metrics."""
