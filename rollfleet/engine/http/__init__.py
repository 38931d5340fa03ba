"""The HTTP side of rank 0, above the model and the scheduler: the app (app) and its routes (routes/)
over the one object they drive (service), the OpenAI-compatible surface (openai_api, chat_messages,
chat_tools), streaming (streaming, stream_text), uvicorn (http_server), and R-Fork's destination,
which drives a seed's routes (remote_pull)."""
