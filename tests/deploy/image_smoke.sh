#!/bin/sh
# Runs inside the fedrl image (tests/deploy/test_image.py), as the manifests run it: the user the
# image names, the services' own entrypoints and flags from deploy/, writes only where the
# manifests mount volumes (/state, /data, /tmp). A tiny run: 1 agent, 2 rounds of 5 local steps.
# Ports come from the test (the build's network is the host's): AGG EVAL AGG_HEALTH AGENT_HEALTH
# AGENT_METRICS EVAL_HEALTH.
set -eu
AGG=$1 EVAL=$2 AGG_HEALTH=$3 AGENT_HEALTH=$4 AGENT_METRICS=$5 EVAL_HEALTH=$6
PIDS=
fail() { echo "IMAGE-SMOKE FAILED: $*"; for f in /tmp/logs/*.log; do echo "== $f"; tail -n 30 "$f"; done; exit 1; }
mkdir -p /tmp/logs && touch /tmp/.start
echo "user $(id -u):$(id -g) home=$HOME cache=$FEDRL_CACHE_DIR path=$PATH"
for d in /state /data /tmp; do touch "$d/.w" 2>/dev/null || fail "$d is not writable by $(id -u)"; rm -f "$d/.w"; done
for c in fedrl fedrl-aggregator fedrl-agent fedrl-evaluator sh; do command -v "$c" >/dev/null || fail "no $c on PATH"; done

fedrl-aggregator --host 127.0.0.1 --port "$AGG" --state-dir /state --metrics-port 0 \
  --health-port "$AGG_HEALTH" > /tmp/logs/aggregator.log 2>&1 &
PIDS=$!
# the base manifests' agent reads /data/shard.hdf5: made here in the data volume from the shipped
# behaviour policy (4 episodes: the local overlay's hopper-medium-v2, 200k rows made the same way,
# took ~40 s of the test; the registry's making is tested outside the image)
fedrl data make --env Hopper-v5 --quality medium --episodes 4 --out /data/shard.hdf5 \
  > /tmp/logs/data.log 2>&1 || fail "fedrl data make failed: $(tail -n 5 /tmp/logs/data.log)"
HOSTNAME=fedrl-agent-0 fedrl-agent --aggregator "127.0.0.1:$AGG" --dataset /data/shard.hdf5 --shards 1 \
  --shard ordinal --trajectories 2 --seed 0 --agent-id fedrl-agent-0 --device cpu --threads 1 \
  --host 127.0.0.1 --health-port "$AGENT_HEALTH" --metrics-port "$AGENT_METRICS" > /tmp/logs/agent.log 2>&1 &
PIDS="$PIDS $!"
fedrl-evaluator --aggregator "127.0.0.1:$AGG" --host 127.0.0.1 --port "$EVAL" --metrics-port 0 \
  --health-port "$EVAL_HEALTH" --num-envs 2 --threads 1 > /tmp/logs/evaluator.log 2>&1 &
PIDS="$PIDS $!"
trap 'kill $PIDS 2>/dev/null || true' EXIT

cat > /tmp/run.json <<JSON
{"algo": "drpo", "agents": 1, "rounds": 2, "local_steps": 5, "eval_episodes": 1, "seed": 0,
 "round_timeout": 600, "join_timeout": 600}
JSON
fedrl ctl --target "127.0.0.1:$AGG" --connect-timeout 600 start --if-idle --config /tmp/run.json \
  > /tmp/logs/start.log 2>&1 || fail "fedrl ctl start failed: $(cat /tmp/logs/start.log)"
timeout 600 fedrl ctl --target "127.0.0.1:$AGG" watch > /tmp/logs/watch.log 2>&1 || true
fedrl ctl --target "127.0.0.1:$AGG" status > /tmp/logs/status.log 2>&1 || fail "fedrl ctl status failed"
cat /tmp/logs/watch.log /tmp/logs/status.log
grep -qi "finished" /tmp/logs/status.log || fail "the run did not finish"
fedrl ctl --target "127.0.0.1:$AGG" fetch --out /tmp/global.safetensors > /tmp/logs/fetch.log 2>&1 \
  || fail "fedrl ctl fetch failed: $(cat /tmp/logs/fetch.log)"
[ -n "$(ls /state)" ] || fail "the aggregator wrote nothing under /state"
kill $PIDS
for p in $PIDS; do wait "$p" || true; done
# readOnlyRootFilesystem: nothing may have been written outside the mounted volumes
W=$(find / -xdev -newer /tmp/.start -type f 2>/dev/null | grep -vE '^/(tmp|state|data|proc|sys|dev|smoke)/' || true)
[ -z "$W" ] || fail "wrote outside /tmp, /state and /data (read-only in the manifests): $W"
echo "IMAGE-SMOKE OK"
