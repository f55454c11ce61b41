#!/usr/bin/env bash
# A private RabbitMQ node with a TLS listener, for the TLS tests, beside the machine's broker,
# and the throwaway certificates it and the tests use.
#
#   stress/tls-node.sh up       make the certificates (once) and start the node (idempotent)
#   stress/tls-node.sh down     stop the node and delete its data and certificates
#   stress/tls-node.sh certs    make the certificates only, and print their directory
#   stress/tls-node.sh env      the variables the TLS tests read, as `export` lines
#
# The node, rtls@localhost, speaks AMQP 0-9-1 and AMQP 1.0 on 127.0.0.1:5675 (plain TCP) and
# on 127.0.0.1:5676 (TLS), and distribution on 25675. Its TLS listener asks for a client
# certificate and accepts a connection without one (verify_peer, fail_if_no_peer_cert
# false); a client certificate signed by the CA may log in with EXTERNAL as the user named
# by its common name. Everything lives under $RTLS_DIR (default /tmp/retry-tls), owned by
# the rabbitmq user. The machine's own node is never touched.
#
# The certificates, in $RTLS_DIR/certs (PEM):
#   ca.pem                 the throwaway CA
#   server.pem server.key  the node's certificate, for the DNS name `localhost` only (so
#                          127.0.0.1 is a wrong host name)
#   client.pem client.key  a client certificate, CN=retry-tls-client (the EXTERNAL user)
#   expired.pem expired.key
#                          a certificate for `localhost`, signed by the CA, valid for one day
#                          in 2020 only
#   other-ca.pem           a second CA that signed nothing the node presents
set -euo pipefail

DIR="${RTLS_DIR:-/tmp/retry-tls}"
CERTS="$DIR/certs"
NODE=rtls@localhost
PLAIN_PORT=5675
TLS_PORT=5676
DIST_PORT=25675
CLIENT_CN=retry-tls-client
RMQ_BIN=/usr/lib/rabbitmq/bin

die() { echo "tls-node.sh: $*" >&2; exit 1; }

as_rabbitmq() {
    if [ "$(id -u)" = "$(id -u rabbitmq)" ]; then
        env HOME=/var/lib/rabbitmq "$@"
    else
        runuser -u rabbitmq -- env HOME=/var/lib/rabbitmq "$@"
    fi
}

ctl() { as_rabbitmq "$RMQ_BIN/rabbitmqctl" -n "$NODE" "$@"; }

running() { ctl -q status >/dev/null 2>&1; }

# A key and a certificate signed by the CA: sign NAME SUBJECT EXTENSIONS [openssl ca dates]
sign() {
    local name="$1" subject="$2" ext="$3"
    shift 3
    openssl req -new -newkey rsa:2048 -nodes -keyout "$CERTS/$name.key" \
        -subj "$subject" -out "$CERTS/$name.csr" 2>/dev/null
    printf '%s\n' "$ext" >"$CERTS/$name.ext"
    if [ $# -eq 0 ]; then
        openssl x509 -req -in "$CERTS/$name.csr" -CA "$CERTS/ca.pem" -CAkey "$CERTS/ca.key" \
            -CAcreateserial -days 30 -sha256 -extfile "$CERTS/$name.ext" \
            -out "$CERTS/$name.pem" 2>/dev/null
    else
        # `openssl ca` is the one that takes explicit validity dates.
        local db="$CERTS/ca-db"
        mkdir -p "$db"
        : >"$db/index.txt"
        [ -f "$db/serial" ] || echo 1000 >"$db/serial"
        cat >"$db/ca.cnf" <<EOF
[ca]
default_ca = throwaway
[throwaway]
database = $db/index.txt
serial = $db/serial
new_certs_dir = $db
certificate = $CERTS/ca.pem
private_key = $CERTS/ca.key
default_md = sha256
policy = anything
unique_subject = no
[anything]
commonName = supplied
EOF
        openssl ca -batch -notext -config "$db/ca.cnf" -in "$CERTS/$name.csr" \
            -extfile "$CERTS/$name.ext" -out "$CERTS/$name.pem" "$@" 2>/dev/null
    fi
    rm -f "$CERTS/$name.csr" "$CERTS/$name.ext"
}

certs() {
    if [ -f "$CERTS/done" ]; then
        return 0
    fi
    command -v openssl >/dev/null || die "no openssl (apt-get install openssl)"
    rm -rf "$CERTS"
    mkdir -p "$CERTS"
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -sha256 -keyout "$CERTS/ca.key" \
        -subj "/CN=retry-engine throwaway CA" -out "$CERTS/ca.pem" 2>/dev/null
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -sha256 -keyout "$CERTS/other-ca.key" \
        -subj "/CN=retry-engine other CA" -out "$CERTS/other-ca.pem" 2>/dev/null
    local server_ext client_ext
    server_ext=$'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost'
    client_ext=$'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth'
    sign server "/CN=localhost" "$server_ext"
    sign client "/CN=$CLIENT_CN" "$client_ext"
    sign expired "/CN=localhost" "$server_ext" -startdate 20200101000000Z -enddate 20200102000000Z
    chmod 644 "$CERTS"/*.pem "$CERTS"/*.key
    touch "$CERTS/done"
}

prepare() {
    mkdir -p "$DIR/mnesia" "$DIR/log"
    cat >"$DIR/rabbitmq.conf" <<EOF
listeners.tcp.1 = 127.0.0.1:$PLAIN_PORT
listeners.ssl.1 = 127.0.0.1:$TLS_PORT
loopback_users = none
ssl_options.cacertfile = $CERTS/ca.pem
ssl_options.certfile = $CERTS/server.pem
ssl_options.keyfile = $CERTS/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
EOF
    echo '[rabbitmq_amqp1_0,rabbitmq_auth_mechanism_ssl].' >"$DIR/enabled_plugins"
    cat >"$DIR/rabbitmq-env.conf" <<EOF
NODENAME=$NODE
NODE_PORT=$PLAIN_PORT
DIST_PORT=$DIST_PORT
ERL_EPMD_ADDRESS=127.0.0.1
MNESIA_BASE=$DIR/mnesia
LOG_BASE=$DIR/log
CONFIG_FILE=$DIR/rabbitmq.conf
ENABLED_PLUGINS_FILE=$DIR/enabled_plugins
PID_FILE=$DIR/pid
# One scheduler: the machine has two cores and its own broker.
SERVER_ADDITIONAL_ERL_ARGS="+S 1:1 +A 4"
export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"
EOF
    chown -R rabbitmq:rabbitmq "$DIR"
}

wait_up() {
    for _ in $(seq 1 120); do
        if ctl -q await_startup >/dev/null 2>&1; then
            return 0
        fi
        sleep 1
    done
    die "$NODE did not start; see $DIR/log"
}

up() {
    [ -x "$RMQ_BIN/rabbitmq-server" ] || die "no RabbitMQ server at $RMQ_BIN"
    id -u rabbitmq >/dev/null 2>&1 || die "no rabbitmq user"
    certs
    if ! running; then
        prepare
        as_rabbitmq env RABBITMQ_CONF_ENV_FILE="$DIR/rabbitmq-env.conf" \
            "$RMQ_BIN/rabbitmq-server" -detached
        wait_up
    fi
    # The EXTERNAL user: no password, so only its certificate logs it in.
    if ! ctl -q list_users --no-table-headers | cut -f1 | grep -qx "$CLIENT_CN"; then
        ctl -q add_user "$CLIENT_CN" "unused-$(date +%s%N)" >/dev/null
        ctl -q clear_password "$CLIENT_CN" >/dev/null
    fi
    ctl -q set_permissions -p / "$CLIENT_CN" '.*' '.*' '.*' >/dev/null
    echo "$NODE up: plain 127.0.0.1:$PLAIN_PORT, TLS 127.0.0.1:$TLS_PORT, certificates in $CERTS"
}

down() {
    if running; then
        ctl -q stop >/dev/null 2>&1 || true
    fi
    local pid
    pid="$(cat "$DIR/pid" 2>/dev/null || true)"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -rf "$DIR"
    echo "$NODE down"
}

env_lines() {
    echo "export RTLS_CERTS=$CERTS"
    echo "export RTLS_PLAIN_PORT=$PLAIN_PORT"
    echo "export RTLS_TLS_PORT=$TLS_PORT"
    echo "export RTLS_CLIENT_CN=$CLIENT_CN"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    certs) certs; echo "$CERTS" ;;
    env) env_lines ;;
    *) sed -n '2,25p' "$0" >&2; exit 2 ;;
esac
