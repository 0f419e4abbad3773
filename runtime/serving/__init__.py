"""deepinfer.runtime.serving: `deepinfer-serve`, the OpenAI HTTP API over a loaded bundle.

- `cli`: the command (parse arguments, then `deepinfer.runtime.serve`);
- `server`: the Starlette app and `serve` (bind, run the engine's thread and uvicorn, stop cleanly);
- `routes`: the routes, one function per group (generation, the service, the tokenizer);
- `params`: request bodies -> checked `Params` (400s with OpenAI's error body);
- `values`: a request's JSON values as refusals see them (a lone surrogate anywhere is refused);
- `responses`: a generation's text as it leaves (stop strings, whole or as server-sent events);
- `engine`: the scheduler on a thread of its own, taking requests while it runs;
- `limits`: the HTTP limits (body size and time, connections, graceful stop, /health's gate);
- `grammars`: structured output (JSON schemas, forced tool calls) as token masks;
- `tool_calls`: `tools`, `tool_choice` and the calls parsed out of a chat's output;
- `logprobs`: log-probabilities in the chat and the legacy completions formats;
- `openapi`: the `/openapi.json` document;
- `server_process`: a real `deepinfer-serve` in a subprocess, for tests and benchmarks.

Not a dependency of `deepinfer.runtime`: `runtime.serve` imports it when a bundle is served. (Named
`serving`, not `serve`: a subpackage `runtime.serve` would replace the function `runtime.serve` on the
`deepinfer.runtime` module once imported.)
"""
