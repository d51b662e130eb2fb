#!/usr/bin/env bash
# Debian's Chromium for the HTML report test (tests/test_visuals.py), when it is not there yet.
# Never fails CI by itself: without a browser that one test skips and says why.
command -v chromium >/dev/null 2>&1 && exit 0
if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >/dev/null 2>&1 \
        || echo "install_browser: could not install chromium; the HTML browser test will skip"
else
    echo "install_browser: no apt-get; the HTML browser test will skip"
fi
exit 0
