# One image for web, worker, beat and (on GPU hosts) the agent.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap gettext \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 suanli
WORKDIR /app
COPY pyproject.toml README.md ./
RUN pip install --upgrade pip && pip install .
COPY . .
RUN DATABASE_URL=postgresql://build@localhost/none REDIS_URL=redis://localhost:6379/0 \
    SECRET_KEY=build-only DEBUG=0 python manage.py collectstatic --no-input -v 0
USER suanli
EXPOSE 8000
CMD ["uvicorn", "portal.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--proxy-headers", "--ws", "portal.ws_relay:WebSocketRelay"]
