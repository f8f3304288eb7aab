# Sourced by this folder's scripts: wait_up PORT [TRIES] polls a server's /health on 127.0.0.1:PORT every 0.25 s
# until it answers 200, TRIES times at most (default 400: 100 s).
wait_up() { for _ in $(seq 1 "${2:-400}"); do curl -sf "127.0.0.1:$1/health" >/dev/null && return; sleep 0.25; done; }
