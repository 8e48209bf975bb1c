# rl_redis: Redis-backed rate limiting for PostgreSQL (PGXS build)

EXTENSION = rl_redis
MODULE_big = rl_redis
OBJS = \
	src/rl_redis.o \
	src/registry.o \
	src/guc.o \
	src/checks.o \
	src/stats.o \
	src/denycache.o \
	src/keys.o \
	src/failure.o \
	src/breaker.o \
	src/tls.o \
	src/resp.o \
	src/topology.o \
	src/queue.o \
	src/conn.o \
	src/shared_queue.o \
	src/io.o \
	src/connect.o \
	src/idle.o \
	src/xact_queue.o \
	src/command.o \
	src/scripts.o \
	src/standalone.o \
	src/cluster.o \
	src/sentinel.o \
	src/router.o \
	src/refund.o \
	src/denials.o \
	src/decision.o \
	src/slots.o \
	src/engine.o \
	src/functions.o \
	src/policy.o \
	src/concurrency.o \
	src/guard.o \
	src/worker.o \
	src/xact_end.o

DATA = $(wildcard sql/rl_redis--*.sql)
PGFILEDESC = "rl_redis - rate limiting in Redis for PostgreSQL"

REGRESS = arguments fixed sliding keys privileges on_error token_bucket gcra sliding_counter refund policy headers concurrency guards postgrest upgrade
REGRESS_OPTS = --inputdir=. --outputdir=. --load-extension=rl_redis

SHLIB_LINK = -lhiredis -lssl -lcrypto
PG_CPPFLAGS = -I$(srcdir)/src
PG_CFLAGS = -Wall -Wextra -Wno-unused-parameter -Wno-sign-compare -Wno-missing-field-initializers

LUA_SCRIPTS = $(sort $(wildcard lua/*.lua))
EXTRA_CLEAN = src/lua_scripts.h results regression.diffs regression.out

PG_CONFIG ?= pg_config
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)

# The Lua scripts are compiled into the library as C strings, as scripts (for
# EVAL) and as one library of Redis functions (for FCALL; its name from a
# SHA1 of the sources, computed here).
# The algorithms are the lines of src/algorithms.h, which both the C files
# and embed_lua.sh read.
src/lua_scripts.h: $(LUA_SCRIPTS) src/embed_lua.sh src/algorithms.h
	sh src/embed_lua.sh lua src/algorithms.h > $@.tmp && mv $@.tmp $@

src/registry.o src/registry.bc: src/lua_scripts.h
$(OBJS): src/rl_redis.h src/compat.h src/algorithms.h
src/resp.o src/queue.o src/conn.o src/io.o src/connect.o src/idle.o src/xact_queue.o src/command.o: src/conn_internal.h

.PHONY: test test-matrix demo bench bench-redis
test:
	bash sql_tests/run_tests.sh

# PostgreSQL 17 and 18, Redis 8 and Valkey 8/9, each in a Debian root
# filesystem (trixie, sid) made once under /var/cache/rl_redis-matrix
test-matrix:
	bash sql_tests/test_matrix.sh

demo:
	bash examples/demo.sh

bench:
	bash sql_tests/bench.sh
	bash sql_tests/bench_cluster.sh
	bash sql_tests/bench_stats.sh
	bash sql_tests/bench_guard.sh
	bash sql_tests/bench_breaker.sh
	bash sql_tests/bench_refund_memory.sh
	bash sql_tests/bench_http.sh
	bash sql_tests/bench_batch.sh
	bash sql_tests/bench_deny_cache.sh

# Redis's side alone (issue 22): each algorithm's FCALL against its plain
# pattern, throughput (target: 0.75 of the plain pattern) and memory per
# identity (fixed window: at most 1.25 times INCR + PEXPIRE), and E8 with
# the plain sliding script as the Redis side
bench-redis:
	bash sql_tests/bench_redis.sh
