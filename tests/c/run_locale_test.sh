#!/bin/sh
# run_locale_test.sh DIR COMMAND...: generates the locales test_locale.c
# checks (a two-byte decimal point: ps_AF, fa_IR; a comma: de_DE) into DIR
# with localedef, then runs COMMAND with LOCPATH=DIR, requiring them. Where
# localedef or the locale sources (Debian's package `locales`) are missing,
# it says so and runs COMMAND without them: test_locale then checks the
# rounding modes and reports each locale as skipped.
dir=$1
shift
mkdir -p "$dir"
ok=1
for l in ps_AF fa_IR de_DE; do
  if [ ! -d "$dir/$l.UTF-8" ]; then
    localedef -i "$l" -f UTF-8 "$dir/$l.UTF-8" >/dev/null 2>&1 || ok=0
  fi
done
if [ "$ok" = 1 ]; then
  LOCPATH=$dir AM_TEST_LOCALES_REQUIRED=1 exec "$@"
fi
echo "run_locale_test.sh: localedef could not build the test locales (package 'locales' missing?): locales skipped" >&2
exec "$@"
