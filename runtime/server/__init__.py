"""The OpenAI-compatible HTTP server: a Falcon WSGI app over one engine, served by waitress.

Modules, in the order a request meets them: config (defaults, HIPC_* environment),
serve (waitress, warmup, signals), app (routes only), auth, resources (thin responders),
validation (every input check), service (prompts, plans, responses), batching (the queue
and batch loop over a batch engine: the cpu and GPU targets), or scheduler + runner (one
request at a time on the engine thread: engines without a batch step), reasoning (<think>
split), openai_format (response, chunk and error shapes), metrics (Prometheus text).

Nothing here is imported until `hipc serve` or `hipc chat` runs.
"""
