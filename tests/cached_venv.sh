# Sourced by tests/{vllm,speculators,specforge}/ensure_venv.sh: a venv made once per machine
# outside the repo (CI on the same machine reuses it), never the project venv. The caller sets
# VENV, MARKER and PY, calls `venv_begin`, installs with `install PACKAGE...` (uv, configured
# as this machine's pip: tests/uv_pip.py) and checks with `step CMD...`, then calls `venv_done`.
# The marker file, written last, makes a half-finished install start over.

venv_ready() {
    [ -f "$MARKER" ] && [ -x "$VENV/bin/python" ]
}

venv_begin() {  # prints the python and exits when the venv is ready; else starts it afresh
    if venv_ready; then
        echo "$VENV/bin/python"
        exit 0
    fi
    mkdir -p "$(dirname "$VENV")"
    exec 9>"$VENV.lock"
    flock 9  # two test processes must not install into the same venv at once
    if venv_ready; then
        echo "$VENV/bin/python"
        exit 0
    fi
    rm -rf "$VENV"
    LOGF="$(dirname "$VENV")/install-$(basename "$VENV").log"
    : >"$LOGF"
    step "$PY" -m venv --without-pip "$VENV"
    mapfile -t UV_PIP < <(python3 "$(dirname "${BASH_SOURCE[0]}")/uv_pip.py")
    [ "${#UV_PIP[@]}" -gt 0 ] || { echo "ensure_venv: tests/uv_pip.py failed" >&2; exit 1; }
}

install() {  # UV_PIP: the uv binary, then pip's settings as uv flags
    step "${UV_PIP[0]}" pip install --python "$VENV/bin/python" "${UV_PIP[@]:1}" "$@"
}

step() {  # run quietly into the log; on failure show its end (minus pip's index noise)
    echo "ensure_venv: $*" >&2
    if ! "$@" >>"$LOGF" 2>&1; then
        grep -v "is ignored: it is neither" "$LOGF" | tail -40 >&2
        echo "ensure_venv: FAILED: $* (full log: $LOGF)" >&2
        exit 1
    fi
}

venv_done() {
    touch "$MARKER"
    echo "$VENV/bin/python"
}
