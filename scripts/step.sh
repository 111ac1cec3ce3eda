# Sourced by the device scripts (scripts/stored_weights_device.sh, scripts/v4_device.sh); needs $out.
# step NAME SECONDS CMD...: run CMD with a time limit, its output to $out/NAME.log; print the exit status and the
# log's last $TAIL lines (default 25), so one slow step does not take the others' time or hide their results.
step() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "=== $name: exit $?"
  tail -n "${TAIL:-25}" "$out/$name.log"
}
