#!/bin/sh
# Install agentd as a systemd service: the documented install, as one script.
#
#   sudo systemd/install.sh [--root DIR] [--source WHEEL_OR_CHECKOUT] [--python PYTHON]
#
# Everything is written under --root (default /), so a test can run the whole install
# in a scratch folder; with the default root it ends by printing the systemctl lines.
# It writes:
#   the system user and group `agentd`            (systemd-sysusers, else useradd)
#   /opt/agentd                                   a virtualenv with agentd installed
#   /etc/agentd/                                  `agentd init`'s files, owned
#       root:agentd 0750; files the daemon must read are 0640; the secrets it
#       reads (clients.yaml, tls/key.pem, operator.key, identity.key) are
#       agentd's own, 0600
#   /etc/agentd/agentctl.env                      AGENTCTL_SOCKET and AGENTCTL_KEY for
#       the unit's ExecReload= (so `systemctl reload agentd` works) and for operators
#   /etc/systemd/system/agentd.service            the unit
#   /usr/lib/sysusers.d/agentd.conf               the user, declared for systemd
#   /usr/share/doc/agentd/operations.md           the unit's Documentation=
# It refuses to overwrite an existing /etc/agentd/organism.yaml (`agentd init` does).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
checkout=$(dirname "$here")
root=/
source=$checkout
python=python3
while [ $# -gt 0 ]; do
    case $1 in
        --root) root=$2; shift 2 ;;
        --source) source=$2; shift 2 ;;
        --python) python=$2; shift 2 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
root=${root%/}
etc=$root/etc/agentd
venv=$root/opt/agentd

# 1. The user. sysusers.d is how systemd declares system users; useradd is the
#    fallback where systemd-sysusers is missing.
install -d -m 0755 "$root/etc" "$root/usr/lib/sysusers.d"
install -m 0644 "$here/agentd.sysusers" "$root/usr/lib/sysusers.d/agentd.conf"
if command -v systemd-sysusers >/dev/null 2>&1; then
    systemd-sysusers --root="${root:-/}" "$root/usr/lib/sysusers.d/agentd.conf"
elif ! grep -q '^agentd:' "$root/etc/passwd" 2>/dev/null; then
    useradd --system --prefix "${root:-/}" --user-group --home-dir /var/lib/agentd \
        --no-create-home --shell /usr/sbin/nologin agentd
fi
uid=$(awk -F: '$1 == "agentd" { print $3 }' "$root/etc/passwd")
gid=$(awk -F: '$1 == "agentd" { print $3 }' "$root/etc/group")
[ -n "$uid" ] && [ -n "$gid" ] || { echo "install.sh: no agentd user in $root/etc/passwd" >&2; exit 1; }

# 2. The virtualenv.
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "$source"

# 3. The configuration: init's files, then owners and modes. The folder and what the
#    daemon only reads belong to root (the daemon cannot change its own
#    configuration); the secrets it must read are its own, mode 0600 (agentd refuses
#    a clients file or key that others can read).
install -d -m 0750 -o 0 -g "$gid" "$etc"
"$venv/bin/agentd" init --dir "$etc" >/dev/null
rmdir "$etc/state" 2>/dev/null || true  # the unit passes --state-dir /var/lib/agentd
chown -R "0:$gid" "$etc"
find "$etc" -type d -exec chmod 0750 {} +
find "$etc" -type f -exec chmod 0640 {} +
for secret in clients.yaml tls/key.pem operator.key identity.key; do
    chown "$uid:$gid" "$etc/$secret"
    chmod 0600 "$etc/$secret"
done
chmod 0600 "$etc"/*.totp  # the first client's secret: for the administrator, root's
cat > "$etc/agentctl.env" <<EOF
# agentctl's defaults for this daemon (ExecReload= of agentd.service reads them).
AGENTCTL_SOCKET=/var/lib/agentd/oob.sock
AGENTCTL_KEY=/etc/agentd/operator.key
EOF
chown "0:$gid" "$etc/agentctl.env"
chmod 0640 "$etc/agentctl.env"

# 4. The unit and its documentation.
install -D -m 0644 "$here/agentd.service" "$root/etc/systemd/system/agentd.service"
install -D -m 0644 "$checkout/docs/operations.md" "$root/usr/share/doc/agentd/operations.md"

if [ "${root:-/}" = / ]; then
    echo "agentd installed. Start it with:"
    echo "  systemctl daemon-reload && systemctl enable --now agentd"
    echo "Operate it as the agentd user:"
    echo "  sudo -u agentd sh -c 'set -a; . /etc/agentd/agentctl.env; /opt/agentd/bin/agentctl status'"
else
    echo "agentd installed under $root"
fi
