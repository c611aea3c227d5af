# Source this (`. .ci/postgres.sh`): a throwaway PostgreSQL for tests/test_db.py on 127.0.0.1:54329 with trust auth, data in
# /tmp/structsearch-pg, database structsearch_test; installs Debian's server when missing. Idempotent; prints nothing unless it fails.
# Exports STRUCTSEARCH_TEST_PG. Stop it with: runuser -u postgres -- /usr/lib/postgresql/*/bin/pg_ctl -D /tmp/structsearch-pg/data stop
ss_pg_start() {
  local dir=/tmp/structsearch-pg port=54329 bin as=""
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; } >/dev/null || return 1
  fi
  bin=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")
  [ "$(id -u)" != 0 ] || as="runuser -u postgres --"  # the server refuses to run as root
  if ! "$bin/pg_isready" -q -h 127.0.0.1 -p $port; then
    mkdir -p $dir && { [ -z "$as" ] || chown postgres: $dir; }
    if [ ! -f $dir/data/PG_VERSION ]; then
      $as "$bin/initdb" -D $dir/data -U postgres --auth=trust >$dir/initdb.log 2>&1 || { cat $dir/initdb.log >&2; return 1; }
    fi
    $as "$bin/pg_ctl" -D $dir/data -l $dir/server.log -w -t 60 -o "-h 127.0.0.1 -p $port -k $dir" start >/dev/null ||
      { cat $dir/server.log >&2; return 1; }
    "$bin/pg_isready" -q -h 127.0.0.1 -p $port -t 30 || { echo "postgres.sh: server on port $port not ready" >&2; return 1; }
  fi
  [ "$("$bin/psql" -X -h 127.0.0.1 -p $port -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'structsearch_test'")" = 1 ] ||
    "$bin/createdb" -h 127.0.0.1 -p $port -U postgres structsearch_test || return 1
  export STRUCTSEARCH_TEST_PG=postgresql+psycopg://postgres@127.0.0.1:$port/structsearch_test
}
ss_pg_start
