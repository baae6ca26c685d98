"""The simulated RDMA NIC: one-sided writes by ``process_vm_writev`` into registered memory.

``nic.py`` is the backend; ``regtable.py`` the table of live regions; ``datapath.py`` one
checked WRITE; ``link.py`` bandwidth caps and injected faults; ``vm.py`` the system call.
"""
