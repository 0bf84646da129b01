# Sourced by the launch recipes: split the remaining arguments into `memexrl train` options and
# key=value overrides (`memexrl train` takes its overrides as one group, after the options).
# Overrides the recipe set before sourcing (e.g. by MODE) are kept; the user's come after them.
opts=()
declare -p overrides >/dev/null 2>&1 || overrides=()
while (($#)); do
  case $1 in
    --resume-from) opts+=("$1" "$2"); shift ;;
    -*) opts+=("$1") ;;
    *) overrides+=("$1") ;;
  esac
  shift
done
