package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoenig/test/must"
)

func TestCheckFile(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		name, body, want string
	}{
		{"mpl.go", "// Copyright (c) HashiCorp, Inc.\n// SPDX-License-Identifier: MPL-2.0\n\npackage x\n", ""},
		{"busl.go", "// Copyright (c) HashiCorp, Inc.\n// SPDX-License-Identifier: BUSL-1.1\n\npackage x\n", "BUSL-1.1 is not a licence"},
		{"dual.go", "// SPDX-License-Identifier: MIT OR Apache-2.0\npackage x\n", ""},
		{"exception.go", "// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception\npackage x\n", ""},
		{"gpl.go", "// SPDX-License-Identifier: GPL-2.0-only\npackage x\n", "GPL-2.0-only is not a licence"},
		{"prose.go", "/*\n * Licensed under the Business Source License 1.1.\n */\npackage x\n", "names the BUSL"},
		// Only the header counts: a string in the code is not a licence.
		{"body.go", "// SPDX-License-Identifier: MIT\npackage x\n\nconst s = \"SPDX-License-Identifier: BUSL-1.1 Business Source License\"\n", ""},
		{"asm_amd64.s", "// SPDX-License-Identifier: BUSL-1.1\nTEXT ·f(SB),0,$0\n", "BUSL-1.1 is not a licence"},
		{"embedded.txt", "Licensed under the Server Side Public License.\n", "names the SSPL"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, tc.name)
			must.NoError(t, os.WriteFile(path, []byte(tc.body), 0o644))
			why, err := checkFile(path)
			must.NoError(t, err)
			if tc.want == "" {
				must.Eq(t, "", why)
				return
			}
			must.StrContains(t, why, tc.want)
		})
	}
}

func TestModuleLicence(t *testing.T) {
	mk := func(files map[string]string) string {
		dir := t.TempDir()
		for name, body := range files {
			must.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644))
		}
		return dir
	}
	mpl := "Mozilla Public License Version 2.0\n==================================\n1.12. \"Secondary License\" means either the GNU General Public License, Version 2.0, the GNU Lesser General Public License..."
	lic, err := moduleLicence(mk(map[string]string{"LICENSE": mpl}))
	must.NoError(t, err)
	must.Eq(t, "MPL-2.0", lic)

	mit := "Permission is hereby granted, free of charge, to any person obtaining a copy\nof this software"
	apache := "Apache License\n Version 2.0, January 2004"
	lic, err = moduleLicence(mk(map[string]string{"LICENSE": apache, "LICENSE.MIT": mit, "README.md": "Business Source License"}))
	must.NoError(t, err)
	must.Eq(t, "Apache-2.0 AND MIT", lic)

	_, err = moduleLicence(mk(map[string]string{"LICENSE": "License text of the Business Source License 1.1\nParameters\nLicensor: HashiCorp"}))
	must.ErrorContains(t, err, "LICENSE is BUSL")

	_, err = moduleLicence(mk(map[string]string{"LICENSE": "GNU AFFERO GENERAL PUBLIC LICENSE Version 3"}))
	must.ErrorContains(t, err, "LICENSE is AGPL")

	_, err = moduleLicence(mk(map[string]string{"README.md": "no licence here"}))
	must.ErrorContains(t, err, "no licence file the check recognises")
}

func TestSPDXIDs(t *testing.T) {
	must.Eq(t, []string{"MIT", "Apache-2.0"}, spdxIDs("(MIT OR Apache-2.0)"))
	must.Eq(t, []string{"Apache-2.0", "BSD-3-Clause"}, spdxIDs("Apache-2.0 WITH LLVM-exception AND BSD-3-Clause"))
	must.Eq(t, "BUSL-1.1", strings.Join(spdxIDs("BUSL-1.1"), ","))
}
